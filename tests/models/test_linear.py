"""The CPU product with its backward written out equals the einsum autodiff differentiates, for
every projection's shape (one input dim, two input dims, several output dims), in value and in both
gradients, float32 and bfloat16."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import linear, qwen


@pytest.mark.parametrize("name", sorted(qwen._PROJECTIONS))
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_the_cpu_product_equals_the_einsum_and_its_gradients(name, dtype, tol):
    equation, n_in = qwen._PROJECTIONS[name]
    x_dims, w_dims = equation.split("->")[0].split(",")
    sizes = dict(b=2, t=5, e=12, h=3, d=4, f=7)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, [sizes[c] for c in x_dims]).astype(dtype)
    w = jax.random.normal(k2, [sizes[c] for c in w_dims]).astype(dtype)
    out_dims = equation.split("->")[1]
    probe = jax.random.normal(k3, [sizes[c] for c in out_dims])  # weighs every output

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * probe)

    einsum = lambda x, w: jnp.einsum(equation, x, w)
    cpu = lambda x, w: linear.project(equation, x, w, n_in, "cpu")
    np.testing.assert_allclose(np.asarray(jax.jit(cpu)(x, w), np.float32),
                               np.asarray(jax.jit(einsum)(x, w), np.float32), rtol=tol, atol=tol)
    got = jax.jit(jax.grad(loss(cpu), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(loss(einsum), argnums=(0, 1)))(x, w)
    for g, v in zip(got, want):
        assert g.shape == v.shape and g.dtype == v.dtype
        scale = float(jnp.abs(v.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(v, np.float32), rtol=0, atol=tol * scale)
