"""Auto-wrap policies: which submodules become FSDP units of their own.

A policy is a callable ``policy(module, name) -> bool`` asked for every submodule (not the root,
which is always a unit). Modules are visited children first, so a parent's parameter count
excludes parameters already taken by wrapped descendants. The names follow torch's
(``ModuleWrapPolicy``, ``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``), but
each is a plain object with one call signature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

WrapPolicy = Callable[[nn.Module, int], bool]  # (module, unwrapped_params) -> wrap?


class ModuleWrapPolicy:
    """Wrap every submodule that is an instance of one of ``module_classes`` (e.g. the
    transformer block class)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes:
            raise ValueError("ModuleWrapPolicy needs at least one module class")

    def __call__(self, module: nn.Module, unwrapped_params: int) -> bool:
        return isinstance(module, self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


def transformer_auto_wrap_policy(transformer_layer_cls: Iterable[type[nn.Module]]
                                 ) -> ModuleWrapPolicy:
    """torch's name for wrapping by class."""
    return ModuleWrapPolicy(transformer_layer_cls)


class SizeBasedWrapPolicy:
    """Wrap a submodule once it holds at least ``min_num_params`` parameters not already
    wrapped by one of its descendants."""

    def __init__(self, min_num_params: int = 100_000_000):
        if min_num_params < 1:
            raise ValueError(f"min_num_params must be at least 1, got {min_num_params}")
        self.min_num_params = min_num_params

    def __call__(self, module: nn.Module, unwrapped_params: int) -> bool:
        return unwrapped_params >= self.min_num_params

    def __repr__(self) -> str:
        return f"SizeBasedWrapPolicy(min_num_params={self.min_num_params})"


def size_based_auto_wrap_policy(min_num_params: int = 100_000_000) -> SizeBasedWrapPolicy:
    """torch's name for wrapping by parameter count."""
    return SizeBasedWrapPolicy(min_num_params)


def modules_to_wrap(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """Submodules of ``root`` (root excluded) that ``policy`` picks, children before parents.

    Counting is bottom-up: a module's unwrapped count excludes parameters of picked
    descendants; shared parameters are counted once, by the first module that holds them.
    """
    picked: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> int:
        count = sum(visit(child, False) for child in module.children())
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
        if not is_root and policy(module, count):
            picked.append(module)
            return 0
        return count

    visit(root, True)
    return picked
