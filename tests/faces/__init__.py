"""Tests of the faces: the API, the command line and its documents, the torch loader, real trainers."""
