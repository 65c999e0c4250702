"""The checkpoint engine's benchmark, `ftsup bench checkpoint`: tooling, never imported by the product.

The parent process (`command`, `launch`, `report`) never imports torch: it plans, launches groups of rank processes
(`rank`, which runs the row modules) and reports.
"""
