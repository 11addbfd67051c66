"""Research code: measurements that are not part of the cache/eval core (``walshkv rd``, ...)."""
