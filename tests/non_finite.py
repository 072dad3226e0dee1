"""The assertion shared by the tests of non-finite values: a result propagates NaN and
infinity exactly as the reference's does."""

import numpy as np


def assert_non_finite_like(got, want, label=""):
    """``got`` has NaN exactly where ``want`` has, ``want``'s infinities (with their signs)
    where it has them, and its finite values within 1e-9."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=label)
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite], want[infinite], err_msg=label)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-9, atol=1e-9, err_msg=label)
