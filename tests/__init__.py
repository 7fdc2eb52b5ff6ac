"""kvbridge's tests; a package so that test modules import ``tests.harness`` by name."""
