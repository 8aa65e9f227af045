"""The commit protocol: publishing versions, the history, writer leases, extraction runs."""
