"""``offload`` for Flax linen Modules, shaped like ``nn.remat``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from flax.core import lift
from flax.linen import transforms as linen_transforms

from jaxoffload import transform

__all__ = ["offload"]

Target = TypeVar("Target")


def offload(
    target: Target,
    *,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    to_host: bool = True,
    variables: Any = True,
    rngs: Any = True,
    methods: Sequence[str] | None = None,
) -> Target:
    """Offloads the residuals of a Module's calls to pinned host memory.

    ``jaxoffload.linen.offload`` has the shape of ``nn.remat``: give it a Module
    class (or a ``functools.partial`` of one) and it returns a Module class; use
    it on a method inside a class body and it returns a method. The variable
    tree does not change, so one ``init`` serves the plain, the remat and the
    offloaded model. Switching between them is one word::

        Block = nn.remat(ConvBlock)            # recompute the residuals
        Block = jaxoffload.linen.offload(ConvBlock)  # move them to the host

    Variables (parameters, ``batch_stats``) are never moved: they live on the
    device for the whole step anyway. Every other residual follows the rules
    of :func:`jaxoffload.offload`. Mutable collections such as ``batch_stats``
    and RNG streams such as ``dropout`` work as under ``nn.remat``.

    Args:
      target: a Module class, a ``functools.partial`` of one, or a method.
      names: optional :func:`~jax.ad_checkpoint.checkpoint_name` names; if
        given, only those values (and the inputs) are kept and moved, and the
        rest is recomputed, as with ``save_only_these_names``.
      min_bytes: residuals smaller than this stay on the device.
      device_argnums: positions of arguments, counting ``self`` as 0, whose
        values stay on the device if they are residuals: for instance an
        input that the layer before keeps on the device anyway, so that
        moving it would free nothing.
      static_argnums: as in ``nn.remat``: positions of non-array arguments,
        counting ``self`` as 0.
      to_host: ``False`` keeps the residuals on the device; the calls still
        take their turn in a :class:`jaxoffload.schedule`.
      variables: the variable collections that are lifted (all by default).
      rngs: the RNG streams that are lifted (all by default).
      methods: the methods to transform when ``target`` is a class; by default
        ``__call__``.

    Returns:
      The transformed Module class or method.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> Dense = jaxoffload.linen.offload(nn.Dense)
      >>> x = jnp.ones((2, 3))
      >>> v = Dense(4).init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, nn.Dense(4).init(jax.random.key(0), x))
      True
    """
    static_argnums = transform._check_argnums("static_argnums", static_argnums)
    device_argnums = transform._check_argnums("device_argnums", device_argnums)
    if any(i == 0 for i in static_argnums + device_argnums):
        raise ValueError(
            "static_argnums and device_argnums: each counts `self` as 0, which cannot be in them."
        )
    return linen_transforms.lift_transform(
        _lifted_offload,
        target,
        variables=variables,
        rngs=rngs,
        names=names,
        min_bytes=min_bytes,
        to_host=to_host,
        # The lifted function takes (variables, rngs, *args): `self` becomes two.
        device_argnums=tuple(i + 1 if i > 0 else i for i in device_argnums),
        static_argnums=tuple(i + 1 if i > 0 else i for i in static_argnums),
        methods=methods,
    )


def _lifted_offload(
    fn: Callable[..., Any],
    variables: Any = True,
    rngs: Any = True,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    to_host: bool = True,
    device_argnums: tuple[int, ...] = (),
    static_argnums: tuple[int, ...] = (),
) -> Callable[..., Any]:
    """``offload`` lifted over Flax scopes, as ``flax.core.lift.checkpoint`` is."""

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        @functools.partial(
            transform.offload,
            names=names,
            min_bytes=min_bytes,
            to_host=to_host,
            device_argnums=(0, 1, *device_argnums),
            static_argnums=static_argnums,
        )
        @functools.wraps(fn)
        def offloaded(variable_groups, rng_groups, *args, **kwargs):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kwargs)
            return y, repack_fn(scope)

        return offloaded(variable_groups, rng_groups, *args, **kwargs)

    return lift.pack(inner, (variables,), (variables,), (rngs,), name="offload")
