"""The I/O under the formats: the local disk, and the object stores checkpoints are read from and written to.

On a disk: ``disk`` opens input files as regular files only and moves and compares their bytes; ``disk_staging``
is a copy's temporary sibling, moved into place once proven; ``ranged`` reads byte ranges as files. In a store:
``interface`` says what a store must do (``Store``, ``WritableStore``) and ``schemes`` which store serves a URL;
``s3`` is the S3 store (boto3, the ``optim-repair[s3]`` extra), ``gcs`` the GCS store (google-auth, the
``optim-repair[gcs]`` extra); ``claim`` is a run's claim on where it writes;
``names`` and ``answers`` check what a store says before it is believed; ``crc`` gives the checksum an object
composed inside a store must have. Nothing here knows a format.
"""
