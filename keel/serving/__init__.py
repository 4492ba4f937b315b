"""``keel serve``: the Open Inference Protocol (KServe v2) over REST and gRPC.

Nothing here is imported by ``import keel``; the web and gRPC packages come
with the ``serve`` extra (``pip install "keel-runtime[serve]"``) and are
imported only when a server starts.
"""
