"""keel's SHA-256: Python's own below a size, OpenSSL's (hashlib) above; the same digests."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from keel._hashing import OPENSSL_FROM, sha256


@pytest.mark.parametrize("size", [0, 3, 4096, OPENSSL_FROM - 1, OPENSSL_FROM, OPENSSL_FROM + 7])
def test_digests_match_hashlib_on_both_sides_of_the_switch(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
    split = sha256(data[:size // 2], size=size)           # fed in parts, size announced
    split.update(data[size // 2:])
    assert split.hexdigest() == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("size", "loads_hashlib"), [(100, False), (OPENSSL_FROM, True)])
def test_only_large_inputs_load_openssl(size: int, loads_hashlib: bool) -> None:
    code = ("import sys\nfrom keel._hashing import sha256\n"
            f"sha256(size={size}).update(b'x')\nprint('hashlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == str(loads_hashlib)
