"""dpcore's programs: the console scripts and the benchmark, with what they share.

Layout (the programs and the dev tools import `peers` and `lib`, `peers` imports `lib`, `lib`
imports neither; tests/test_experiments_layout.py checks it):
  * `dpcore_experiments.<program>`: the binaries (`train`, `finetune`, `audit`,
    `gradient_stats`, `launch_local`, `tfp_tutorial`: the `dpcore-*` console scripts;
    `benchmark`). Each defines its flags and calls into the packages below.
  * `dpcore_experiments.dev`: developer tools (interleaved before/after timings, soak runs, the
    multi-worker and fit-sampling benchmarks); they use `lib` and `peers`, not the binaries.
  * `dpcore_experiments.peers`: the reference peer (TensorFlow Privacy 0.9.0 in its own
    environment) and the parity checks against it.
  * `dpcore_experiments.lib`: the binaries' shared library (program body, output files,
    models, data, training and benchmark steps); it imports no binary.
`dpcore-epsilon` ships from `dpcore_accounting.cli` (`dpcore_experiments.epsilon`, its old path,
warns and goes in the next release).
"""
