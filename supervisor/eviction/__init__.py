"""Eviction watchers: each turns one kind of notice into one `Notice` with a deadline.

| module      | notice                                                         | impure? |
|-------------|----------------------------------------------------------------|---------|
| `notices`   | the `Notice`/`Blind` values and parsing of provider responses   | no      |
| `http`      | a tiny stdlib HTTP client for link-local metadata endpoints     | yes     |
| `providers` | AWS (IMDSv2), GCP (long-poll), Azure (Scheduled Events + ack)    | yes     |
| `local`     | a file that appears, a command that prints a notice             | yes     |
| `runner`    | threads that poll watchers and hand notices to the daemon       | yes     |

POSIX signals are notices too; the daemon's signal handler creates them (`notices.from_signal`).

A watcher that cannot see (endpoint down, slow, garbage) reports `Blind` — never "no eviction".
"""
