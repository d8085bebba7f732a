# perf_analyzer input files and helpers: see README.md here.
