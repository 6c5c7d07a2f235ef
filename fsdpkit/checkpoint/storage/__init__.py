"""Where checkpoint bytes live: one small storage face (ranged reads, list, write streams,
commit, delete, conditional create) over a local directory and over object stores (S3, GCS,
Azure through obstore). `open_storage` picks the one a path or URL names."""
