"""Fast paths, each with a pure-torch `*_ref` twin that the tests compare against."""
