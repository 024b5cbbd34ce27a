"""Object storage: the ``s3://`` checkpoints optim-repair reads by range and writes by server-side copy.

``s3`` holds the one client (boto3, the ``optim-repair[s3]`` extra): listing, ranged reads coalesced per
object, writes that never replace, server-side copies proven by the store's checksums, and deletion of what
a run wrote. Local paths do not pass through here: the formats read them as files.
"""
