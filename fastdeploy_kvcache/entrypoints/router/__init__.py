"""The router: one OpenAI-compatible endpoint in front of many servers.

``python -m fastdeploy_kvcache.entrypoints.router --worker-urls URL ... [--worker-events ...]``
routes each request to one of N interchangeable workers (:mod:`.fleet`, policies in
:mod:`.policy`, the workers' cache state from their KV events in :mod:`.events` and
:mod:`.view`); ``--prefill-url URL --decode-url URL`` runs the prefill/decode split
instead (:mod:`.pd`).  Flags: :mod:`.cli`; the guide is ``docs/fleet.md``.
"""
