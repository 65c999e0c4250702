"""`ftsup bench scale`: the metadata costs (save plan, commit, resume choice, refresh) at N simulated ranks."""
