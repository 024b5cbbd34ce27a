"""Object storage: the checkpoints optim-repair reads by range and writes by server-side copy (``s3://``).

``interface`` says what a store must do (``Store``, ``WritableStore``) and ``schemes`` which store serves a URL;
``s3`` is the S3 store (boto3, the ``optim-repair[s3]`` extra). ``claim`` is a run's claim on where it writes;
``names`` and ``answers`` check what a store says before it is believed; ``crc`` gives the checksum an object
composed inside a store must have; ``ranged`` reads an object as a file. Local paths do not pass through here: the
formats read them as files.
"""
