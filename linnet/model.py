"""What a loaded card is, whatever the backend: weights under the card's
groups, generated source executed into entries, and checked calls.

linnet/torch/model.py and linnet/jax/model.py fill in how tensors are made,
converted and compiled for their framework."""

from __future__ import annotations

import linecache
from abc import ABC, abstractmethod

from linnet.cardlang.check import Checked
from linnet.cards import Card
from linnet.emit.source import Backend, emit
from linnet.generics import check_inputs
from linnet.weights import WeightSpec, check_checkpoint, checkpoint_files, locate, read_tensors, weight_specs


class LoadedModel(ABC):
    backend: Backend

    def __init__(self, card: Card, checked: Checked, *, generics: dict, numerics: str, cast_dtype: bool, entries: list[str]):
        self.card, self.checked, self.generics = card, checked, generics
        self.numerics, self.cast_dtype, self.entries = numerics, cast_dtype, entries
        self.params: dict = {}
        self._install(self.emit(), {})

    # Generated code.

    def emit(self, sharded: bool = False, schedule=None) -> str:
        return emit(self.checked, self.backend, card_name=self.card.name, generics=self.generics, numerics=self.numerics,
                    cast_dtype=self.cast_dtype, entries=self.entries, sharded=sharded, schedule=schedule)

    def _install(self, source: str, namespace: dict) -> None:
        """Executes generated source and makes its entries this model's."""
        self.source = source
        self.functions = self.execute(source, namespace)
        self._compiled = {entry: self._compile(function) for entry, function in self.functions.items()}

    def execute(self, source: str, namespace: dict) -> dict:
        """The entries of generated source, executed with `namespace` (what sharded source calls) bound."""
        filename = f"<linnet {self.card.name} {self.backend.name}{' sharded' if namespace else ''}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
        scope = dict(namespace)
        exec(compile(source, filename, "exec"), scope)
        return {entry: scope[entry] for entry in self.entries}

    def _compile(self, function):
        return function

    # Weights.

    def specs(self) -> list[WeightSpec]:
        return weight_specs(self.checked)

    def load_checkpoint(self, source) -> None:
        files = checkpoint_files(locate(source))
        specs = check_checkpoint(self.checked, files)
        for spec, tensor in read_tensors(specs, files, device=self._read_device()):
            self._place(spec, self._convert(tensor))

    def init_random(self, seed: int) -> None:
        """Normal(0, initializer_range) matrices and unit norms, as transformers initialises Llama."""
        std = float(self.card.config.get("initializer_range", 0.02))
        draw = self._random_drawer(seed)
        for spec in self.specs():
            self._place(spec, draw(spec, std))

    def _place(self, spec: WeightSpec, tensor) -> None:
        if spec.index is None:
            self.params.setdefault(spec.group, {})[spec.name] = tensor
        else:
            layers = self.params.setdefault(spec.group, [])
            while len(layers) <= spec.index:
                layers.append({})
            layers[spec.index][spec.name] = tensor

    def named_weights(self):
        """(checkpoint name, tensor) for every weight, in checkpoint order; tied ones once."""
        for spec in self.specs():
            group = self.params[spec.group]
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
        self._check_placement(entry, inputs)
        check_inputs(self.checked, self.generics, entry, [tuple(x.shape) for x in inputs], [self._kind(x) for x in inputs])
        return self._compiled[entry](self.params, *inputs)

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
            raise TypeError(f"this model has entries {self.entries}: call one by name, e.g. model.{self.entries[0]}(...)")
        return self.run(self.entries[0], *inputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.card.name}, entries={self.entries}, numerics={self.numerics!r})"
