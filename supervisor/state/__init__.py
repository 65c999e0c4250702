"""What the supervisor keeps and reads back: the journal, the ranks as last heard, rollback requests, store scans."""
