"""Flags of `warmroute check`; the check itself lives in gateway.check."""
from __future__ import annotations

import argparse

DESCRIPTION = """\
Is a deployed gateway (or Endpoint Picker) ready and answering? Waits for the admin port's /readyz,
then, with --url, lists the API's models and asks the first for one token. With auth on and no key
given, the API must refuse the listing with 401 (auth enforced) and the completion is skipped.
Each step prints one line; exit 0 when every step passed, 1 otherwise. What the chart's `helm test`
runs. The API key is read from an environment variable and never printed."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-url", required=True, metavar="URL",
                   help="the admin port's base URL (e.g. http://warmroute-admin:9090)")
    p.add_argument("--url", default=None, metavar="URL",
                   help="the API's base URL (e.g. http://warmroute:8000); default: none, only readiness is checked")
    p.add_argument("--api-key-env", default="WARMROUTE_CHECK_API_KEY", metavar="NAME",
                   help="environment variable holding an API key for the listing and the completion "
                        "(default: WARMROUTE_CHECK_API_KEY; unset or empty: no key is sent)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness, and for each request")
