"""Origins: where a weights object named by URL really lives (S3, HTTP(S), a local file),
read by byte range, always of one version."""
