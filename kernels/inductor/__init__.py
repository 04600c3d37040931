"""What reaches into Inductor's internals: the modules that patch or rewrite
what Inductor generates and builds, and the probe of the vector ISAs it
compiles for.

Each module names the torch internals it relies on in its ``INTERNALS``
(checked by :func:`aoti_eager.kernels.inductor.internals.missing`, quoted in
its docstring) and says what happens where one has moved: the patch is
skipped and Inductor's own code runs, or a clear error names the internal.
"""
