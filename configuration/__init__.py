"""The configuration tree's machinery: field metadata, value parsers, and the flags and
reference generated from the tree. It imports nothing else of pdserve, so every layer can use it."""
