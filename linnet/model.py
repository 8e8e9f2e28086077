"""What a loaded card is, whatever the backend: weights under the card's
groups, generated source executed into entries, and checked calls.

linnet/torch/model.py and linnet/jax/model.py fill in how tensors are made,
converted and compiled for their framework."""

from __future__ import annotations

import linecache
import os
from abc import ABC, abstractmethod
from math import prod
from pathlib import Path

from linnet.cardlang.check import Checked
from linnet.cards import Card
from linnet.emit.source import Backend, Emitted, emit
from linnet.cardlang.generics import check_inputs
from linnet.sharding.schedule import check_bindings
from linnet.hf.read import (CheckpointWeights, RandomWeights, WeightSpec, check_checkpoint, checkpoint_files, grouped,
                            locate, read_tensors, weight_specs)


class LoadedModel(ABC):
    backend: Backend

    def __init__(self, card: Card, checked: Checked, *, generics: dict, numerics: str, cast_dtype: bool,
                 entries: list[str]):
        self.card, self.checked, self.generics = card, checked, generics
        self.numerics, self.cast_dtype, self.entries = numerics, cast_dtype, entries
        self._params: dict = {}
        self.weight_source: RandomWeights | CheckpointWeights | None = None  # until the weights are read
        self.install(self.emit().source, {})

    # Generated code.

    layer_region = False  # a layer loop's function compiled once for every layer (PyTorch, see TorchModel)

    def emit(self, sharded: bool = False, schedule=None, primitives: dict | None = None) -> Emitted:
        """This model's module, as `linnet.emit.source.emit` writes it for its card, generics and entries."""
        return emit(self.checked, self.backend, card_name=self.card.name, generics=self.generics,
                    numerics=self.numerics, cast_dtype=self.cast_dtype, entries=self.entries, sharded=sharded,
                    schedule=schedule, layer_region=self.layer_region, primitives=primitives)

    def install(self, source: str, namespace: dict) -> None:
        """Executes generated source, with `namespace` (the functions sharded source calls) bound, and makes its
        entries this model's."""
        self.source = source
        self.functions = self.execute(source, namespace)
        self._compiled = {entry: self._compile(function) for entry, function in self.functions.items()}

    def execute(self, source: str, namespace: dict) -> dict:
        """The entries of generated source, executed with `namespace` (what sharded source calls) bound: every
        function the source calls and does not define must be there, and nothing else
        (linnet.sharding.schedule.check_bindings)."""
        filename = f"<linnet {self.card.name} {self.backend.name}{' sharded' if namespace else ''}>"
        check_bindings(source, namespace, filename)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
        scope = dict(namespace)
        exec(compile(source, filename, "exec"), scope)
        return {entry: scope[entry] for entry in self.entries}

    def _compile(self, function):
        return function

    # Weights.

    def specs(self) -> list[WeightSpec]:
        return weight_specs(self.checked)

    @property
    def params(self) -> dict:
        """The weights under the card's groups (params["layers"][i]["wq"]), read whole when first needed."""
        if self.weight_source is not None:
            self._read_whole()
        return self._params

    @params.setter
    def params(self, params: dict) -> None:
        self._params, self.weight_source = params, None

    def load_checkpoint(self, source) -> None:
        """Checks the checkpoint's names and shapes from its headers now; reads it when first needed."""
        files = checkpoint_files(locate(source))
        check_checkpoint(self.checked, files)
        self.weight_source = CheckpointWeights(files)

    def init_random(self, seed: int) -> None:
        """Normal(0, initializer_range) matrices and unit norms, as transformers initialises Llama; drawn when
        first needed, whole or (sharded first) group by group, the same values either way."""
        self.weight_source = RandomWeights(seed, float(self.card.config.get("initializer_range", 0.02)))

    def _read_whole(self) -> None:
        source, specs = self.weight_source, self.specs()
        self._check_fits(sum(prod(spec.shape) for spec in specs))
        if isinstance(source, RandomWeights):
            draw = self._random_drawer(source.seed)
            tensors = ((spec, draw(spec, source.std)) for spec in specs)
        else:
            tensors = ((spec, self._convert(tensor))
                       for spec, tensor in read_tensors(specs, source.files, device=self._read_device()))
        self.params = grouped(tensors)

    def _check_fits(self, elements: int) -> None:
        """Raises, before anything is allocated, when the whole model cannot fit where its weights would go."""
        needed, (where, free) = elements * self._weight_itemsize(), self._free_memory()
        if needed > free:
            raise MemoryError(
                f"{self.card.name} has {elements / 1e9:.2f} billion parameters: its weights need "
                f"{needed / 2**30:.1f} GiB on {where}, which has {free / 2**30:.1f} GiB free. Shard it before it "
                f"is used: {self._shard_hint} reads only each rank's part of every weight.")

    def _free_memory(self) -> tuple[str, int]:
        """(where the weights go, how many bytes are free there): the host's available memory by default."""
        try:
            meminfo = Path("/proc/meminfo").read_text().splitlines()
            return "the host", int(next(line.split()[1] for line in meminfo if line.startswith("MemAvailable:"))) * 1024
        except (OSError, StopIteration):
            return "the host", os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    _shard_hint = "sharding"

    @abstractmethod
    def _weight_itemsize(self) -> int:
        """Bytes an element of a weight takes."""

    def named_weights(self):
        """(checkpoint name, tensor) for every weight, in checkpoint order; tied ones once."""
        params = self.params
        for spec in self.specs():
            group = params[spec.group]
            yield spec.checkpoint_name, (group[spec.name] if spec.index is None else group[spec.index][spec.name])

    def _read_device(self) -> str:
        return "cpu"

    @abstractmethod
    def _convert(self, tensor):
        """A tensor read from a checkpoint (torch, on the read device) as this backend's weight."""

    @abstractmethod
    def _random_drawer(self, seed: int):
        """draw(spec, std) -> a random weight for spec."""

    # Entries.

    def run(self, entry: str, *inputs):
        if entry not in self._compiled:
            raise AttributeError(f"{self.card.name} was loaded with entries {self.entries}, not {entry!r}")
        self._agree(lambda: self._check_inputs(entry, inputs), f"{entry}() inputs")
        return self._call(entry, inputs)

    def _call(self, entry: str, inputs):
        """The entry's compiled function, called with the weights and checked inputs."""
        return self._compiled[entry](self.params, *inputs)

    def _check_inputs(self, entry: str, inputs) -> None:
        self._check_placement(entry, inputs)
        check_inputs(self.checked, self.generics, entry, [tuple(x.shape) for x in inputs],
                     [self._kind(x) for x in inputs])

    def _agree(self, check, what: str) -> None:
        """check(); where a call is collective (a sharded PyTorch model), every rank raises when any rank's
        check raised, rather than the others wait in a gather for the rank that stopped."""
        check()

    def _check_placement(self, entry: str, inputs) -> None:  # noqa: B027 (optional: backends that place tensors check it)
        """Raises if an input is not where the model's weights are."""

    @abstractmethod
    def _kind(self, tensor) -> str:
        """"int" or "float": what kind of input tensor this is."""

    def __getattr__(self, name: str):
        if name in self.__dict__.get("entries", ()):
            return lambda *inputs: self.run(name, *inputs)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __call__(self, *inputs):
        if len(self.entries) != 1:
            raise TypeError(f"this model has entries {self.entries}: call one by name, "
                            f"e.g. model.{self.entries[0]}(...)")
        return self.run(self.entries[0], *inputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.card.name}, entries={self.entries}, numerics={self.numerics!r})"

