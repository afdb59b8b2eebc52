pytest_plugins = [
    "tests.fixtures.redis",
    "tests.fixtures.docker",
    "tests.fixtures.triton",
    "tests.fixtures.netns",
    "tests.fixtures.browser",
    "tests.fixtures.sandbox",
]
