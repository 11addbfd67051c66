"""walshkv research: PrimePE rotary frequencies, K/V spectra, basis and reconstruction studies.

Not part of the installed walshkv core: install with ``pip install -e research`` (its commands join the
``walshkv`` CLI). It imports walshkv; walshkv never imports it.
"""
