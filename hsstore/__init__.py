"""hsstore: LLM hidden states as a first-class dataset.

Public API: `create`, `open`, `verify`, `gc`, `repair`, `Dataset`, `Sample`, `Writer`, `LayerSpec`,
the errors in `hsstore.errors` and `DamageWarning`. See docs/API.md and docs/FORMAT.md.
"""

from hsstore.dataset.create import create
from hsstore.dataset.dataset import Dataset, open
from hsstore.dataset.integrity import VerifyReport, gc, verify
from hsstore.dataset.repair import RepairReport, repair
from hsstore.dataset.sample import Sample
from hsstore.dataset.segment_set import DamageWarning
from hsstore.dataset.writer import Writer
from hsstore.errors import (
    BadInputError,
    CommitUnknownError,
    ConflictError,
    ConventionError,
    DuplicateSampleError,
    FormatError,
    HsstoreError,
    IncompatibleDatasetError,
    IntegrityError,
    LoaderStateError,
    MissingExtraError,
    NotADatasetError,
    SchemaError,
    SegmentRemovedError,
    StorageError,
    UnsupportedVersionError,
)
from hsstore.spec.layers import LayerSpec
from hsstore.spec.manifest import Manifest, ModelInfo

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "CommitUnknownError",
    "ConflictError",
    "ConventionError",
    "DamageWarning",
    "Dataset",
    "DuplicateSampleError",
    "FormatError",
    "HsstoreError",
    "IncompatibleDatasetError",
    "IntegrityError",
    "LayerSpec",
    "LoaderStateError",
    "MissingExtraError",
    "Manifest",
    "ModelInfo",
    "NotADatasetError",
    "RepairReport",
    "Sample",
    "SchemaError",
    "SegmentRemovedError",
    "StorageError",
    "UnsupportedVersionError",
    "VerifyReport",
    "Writer",
    "create",
    "gc",
    "open",
    "repair",
    "verify",
]
