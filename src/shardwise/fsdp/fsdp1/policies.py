"""Auto-wrap policies: which submodules become FSDP units of their own.

A policy has torch's signature ``policy(module, recurse, nonwrapped_numel) -> bool`` and is
asked the way torch's FSDP1 asks it (``modules_to_wrap``): on the way down, ``recurse=True``
with every parameter of ``module`` counted ("should I look inside?"); on the way back up,
``recurse=False`` with the parameters that no wrapped descendant took ("should this module be a
unit?"). The root is never asked the second question: it is always a unit. So torch's own
idioms work unchanged::

    functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    functools.partial(size_based_auto_wrap_policy, min_num_params=1_000_000)

as do torch's policy functions themselves, torch's ``ModuleWrapPolicy`` and ``CustomPolicy``
objects (a ``CustomPolicy`` that returns per-module keyword overrides is refused), and our
``ModuleWrapPolicy`` / ``SizeBasedWrapPolicy`` classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

WrapPolicy = Callable[..., bool]  # (module, recurse, nonwrapped_numel) -> bool


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Every submodule becomes a unit."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Look inside every module; wrap those for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Look inside every module; wrap instances of ``transformer_layer_cls`` (bind it with
    ``functools.partial``)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None
                                ) -> bool:
    """Wrap a module once the parameters not taken by wrapped descendants number at least
    ``min_num_params``. Modules of ``force_leaf_modules`` (default
    ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``: ``nn.MultiheadAttention``) are not
    looked inside; modules of ``exclude_wrap_modules`` (default ``EXCLUDE_WRAP_MODULES``:
    ``nn.ModuleList``, ``nn.ModuleDict``) are never wrapped themselves."""
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    if nonwrapped_numel < min_num_params:
        return False
    skip = force_leaf_modules if recurse else exclude_wrap_modules
    return not isinstance(module, tuple(skip))


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore


class ModuleWrapPolicy:
    """Wrap every submodule that is an instance of one of ``module_classes`` (e.g. the
    transformer block class)."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes:
            raise ValueError("ModuleWrapPolicy needs at least one module class")

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = -1) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel,
                                            self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


class SizeBasedWrapPolicy:
    """``size_based_auto_wrap_policy`` with ``min_num_params`` bound, as an object."""

    def __init__(self, min_num_params: int = 100_000_000):
        if min_num_params < 1:
            raise ValueError(f"min_num_params must be at least 1, got {min_num_params}")
        self.min_num_params = min_num_params

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel,
                                           self.min_num_params)

    def __repr__(self) -> str:
        return f"SizeBasedWrapPolicy(min_num_params={self.min_num_params})"


def modules_to_wrap(root: nn.Module, policy: Any,
                    ignored_modules: Iterable[nn.Module] = (),
                    ignored_params: Iterable[nn.Parameter] = ()) -> list[nn.Module]:
    """Submodules of ``root`` (root excluded) that ``policy`` picks, children before parents.

    ``ignored_modules`` and their subtrees are neither asked nor counted; ``ignored_params``
    are not counted. torch's policy objects (``ModuleWrapPolicy``, ``CustomPolicy``: they
    have ``_run_policy``) pick their modules themselves; they are returned in post-order.
    """
    ignored_mods = {id(m) for m in ignored_modules}
    ignored = {id(p) for p in ignored_params}
    if hasattr(policy, "_run_policy"):
        return _torch_policy_targets(root, policy, ignored_modules)
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy must be callable as policy(module, recurse, "
                        f"nonwrapped_numel), got {type(policy).__name__}")
    picked: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        """Like torch's recursion: returns the parameter count this subtree had wrapped."""
        total = sum(p.numel() for p in module.parameters() if id(p) not in ignored)
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        wrapped = sum(visit(child, False) for child in module.children()
                      if id(child) not in ignored_mods)
        if not is_root and policy(module=module, recurse=False,
                                  nonwrapped_numel=total - wrapped):
            picked.append(module)
            return total
        return wrapped

    visit(root, True)
    return picked


def _torch_policy_targets(root: nn.Module, policy: Any,
                          ignored_modules: Iterable[nn.Module]) -> list[nn.Module]:
    targets = policy._run_policy(root, set(ignored_modules), {})
    overrides = {type(m).__name__: kw for m, kw in targets.items() if kw}
    if overrides:
        raise NotImplementedError(f"auto_wrap_policy {type(policy).__name__} gives per-module "
                                  f"keyword overrides {overrides}; units take the root's "
                                  "options here, so return True instead of a dict")
    order: list[nn.Module] = []
    seen: set[int] = set()

    def post_order(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                post_order(child)
        order.append(module)

    post_order(root)
    return [m for m in order if m in targets and m is not root]
