"""The checkpoint as a whole: discovery, reading, writing and staging.

``discovery`` says what an argument holds, ``reading`` reads it into one inventory, and ``writing``
writes a verified copy through a temporary sibling that ``staging`` keeps and renames into place.
"""
