"""Object storage: the ``s3://`` checkpoints optim-repair reads by range and writes by server-side copy.

``s3`` holds the one client (boto3, the ``optim-repair[s3]`` extra): listing, ranged reads coalesced per object;
``s3_writes`` the writes that never replace, server-side copies and deletes pinned to a version; ``claim`` a
run's claim on where it writes; ``names`` and ``answers`` check what a store says before it is believed;
``compose`` and ``crc`` build an object from new bytes and ranges of another; ``ranged`` reads an object as a
file. Local paths do not pass through here: the formats read them as files.
"""
