"""Runtime patches of other projects (verl, vLLM, SGLang).

Every patch here names the versions it was written for, checks that what it patches exists,
and raises :class:`PatchError` with a one-line reason on a mismatch. Nothing outside this
folder modifies another project's objects.
"""
from tlt_verl.patches._guard import PatchError, require_attr, require_version, when_imported

__all__ = ["PatchError", "require_attr", "require_version", "when_imported"]
