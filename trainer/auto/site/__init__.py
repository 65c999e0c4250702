"""The directory `ftsup run` puts first on the ranks' `PYTHONPATH`: it holds their start-up hook, `sitecustomize`."""
