"""Proving a written copy from disk: every original byte unchanged, and the planned additions present.

One home for verification: ``files`` (what was proven, and files copied as they are), with one part
per format beside it (``torchfile``, ``dcp``). Every comparison goes through
``optim_repair.formats.ranges.same_range``.
"""

from optim_repair.verify.dcp import verify_dcp, verify_planned_dcp
from optim_repair.verify.files import NOTHING, Verification, verify_copied_file
from optim_repair.verify.torchfile import verify_torch_file

__all__ = ["NOTHING", "Verification", "verify_copied_file", "verify_dcp", "verify_planned_dcp", "verify_torch_file"]
