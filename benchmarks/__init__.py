"""numbaconv's airspeed velocity (asv) benchmarks; see asv.conf.json at the repository root.

The shapes, the calls timed and the dispatch-overhead measurement come from
:mod:`numbaconv.bench`, shared with ``numbaconv bench`` and the tests.
"""
