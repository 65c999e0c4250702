"""Eviction watchers: each turns one kind of notice into one `Notice` with a deadline, or says it is blind.

The modules and what each watches: docs/design/eviction.md.
"""
