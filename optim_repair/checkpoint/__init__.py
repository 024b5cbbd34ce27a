"""The checkpoint as a whole: what one listing finds, read by one loop, planned once, and copied wherever it goes.

``discovery`` says what a local argument holds and ``stored`` what a store's prefix holds; ``reading`` reads either
listing into one inventory; ``planning`` finishes the repair in every file's format; ``copies`` writes the verified
copy where ``--out`` is, through ``writing`` (onto a disk) or ``store_writing`` (into a store).
"""
