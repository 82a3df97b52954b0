"""The tools around the method: the command line, the benchmarks, the GPU check, the bundled pair and documents,
the needle generator, the attention probe and prompting (text to prompt ids). They import the core
(`specextend`), never the other way round."""
