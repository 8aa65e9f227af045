"""``LoaderOptions``: every option of the loader's plan, defined once.

``Loader``, ``HiddenStateStream`` and ``PlannedBatchSampler`` take these options as keywords
(``Loader(path, max_tokens=4096, follow=True)``) or as one object (``options=``); either way
they build one ``LoaderOptions`` at the door and hand that object on unchanged. Their
signatures list the fields below (``shows_options``), so ``help(Loader)`` shows every option
with its default. docs/LOADER.md says what each one does.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hsstore.loader.decode_paths import check_decode_path
from hsstore.loader.fetch import BatchShape
from hsstore.loader.follow import FollowConfig
from hsstore.loader.plan import PlanConfig


@dataclass(frozen=True)
class LoaderOptions:
    """What fixes a rank's batches: the plan, the batch layout, the layers, the rank, and
    whether (and how) to follow a dataset as it grows."""

    # the plan (plan.PlanConfig): which sample lands in which batch
    max_tokens: int = 8192
    batch_size: int | None = None  # None: packed batches of up to max_tokens tokens
    pad_to_multiple_of: int = 8
    open_bins: int = 4
    shuffle: bool = True
    seed: int = 0
    block_size: int = 64
    window: int = 1024
    over_long: str = "truncate"
    tail: str = "pad"
    # what a batch carries
    aux_layers: tuple[int, ...] | None = None  # stored layer positions (default: all but last)
    verifier: bool = True
    pad_token_id: int = 0
    # who reads: default torch.distributed's rank and world size, else (0, 1)
    rank: int | None = None
    world_size: int | None = None
    verify_reads: bool | None = None  # checksum every read (default: the dataset's, else True)
    skip_damaged: bool = False  # Loader: blank samples that fail their checks and go on
    # how batches are decoded (decode_paths.DECODE_PATHS); every path yields the same batches
    decode_path: str = "auto"
    # following a growing dataset (follow.FollowConfig)
    follow: bool = False
    follow_window: int = 256
    follow_until: int | None = None
    follow_poll_s: float = 0.5
    follow_timeout_s: float | None = None
    follow_from: int | None = None  # the version the first window is (default: the latest)

    def __post_init__(self) -> None:
        if self.aux_layers is not None:  # a list given keeps the options immutable as a tuple
            object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        self.plan_config()  # refuse bad values here, where the caller passed them
        check_decode_path(self.decode_path)
        self.follow_config()

    def plan_config(self) -> PlanConfig:
        return PlanConfig(
            max_tokens=self.max_tokens,
            batch_size=self.batch_size,
            pad_to_multiple_of=self.pad_to_multiple_of,
            open_bins=self.open_bins,
            shuffle=self.shuffle,
            seed=self.seed,
            block_size=self.block_size,
            window=self.window,
            over_long=self.over_long,
            tail=self.tail,
        )

    def batch_shape(self) -> BatchShape:
        return BatchShape(
            packed=self.batch_size is None,
            max_tokens=self.max_tokens,
            batch_size=self.batch_size,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pad_token_id=self.pad_token_id,
        )

    def follow_config(self) -> FollowConfig | None:
        if not self.follow:
            return None
        return FollowConfig(
            self.follow_window, self.follow_until, self.follow_poll_s, self.follow_timeout_s
        )

    @classmethod
    def of(cls, options: LoaderOptions | None, overrides: dict[str, Any]) -> LoaderOptions:
        """``options`` (default: all defaults) with ``overrides`` replaced; an unknown name is
        a ``TypeError`` naming it, as for any keyword argument."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown loader options {unknown} (see LoaderOptions)")
        base = cls() if options is None else options
        return dataclasses.replace(base, **overrides) if overrides else base


F = TypeVar("F", bound=Callable[..., Any])


def shows_options(init: F) -> F:
    """Give a constructor that takes ``**options`` a signature listing ``LoaderOptions``'
    fields as keyword parameters with their defaults (what ``help()`` and IDEs show)."""
    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in dataclasses.fields(LoaderOptions)
    ]
    init.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return init
