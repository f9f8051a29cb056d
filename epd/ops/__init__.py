"""Operator tools over a running server's ``/metrics``: ``epd diagnose`` (:mod:`epd.ops.diagnose`)
names its bottleneck, ``epd plan`` (:mod:`epd.ops.plan`) profiles it and sizes its pools;
:mod:`epd.ops.scrape` reads the metrics both use."""
