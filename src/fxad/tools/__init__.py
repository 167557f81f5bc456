"""Developer tools built on the library: the OpInfo coverage sweep (:mod:`fxad.tools.coverage`),
the real-model suite (:mod:`fxad.tools.models`), the supported-ops list generator
(:mod:`fxad.tools.supported_ops`) and the program fuzzer (:mod:`fxad.tools.fuzz`).  They use
fxad through its public API and sit above every library layer; nothing in the library imports
them."""
