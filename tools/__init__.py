"""Developer tools run from the repository, never installed: benchmarks, test fixtures and
GPU check scripts. (The tiny demo model lives in the library, `hsstore.demo_model`.)"""
