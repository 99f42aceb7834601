//go:build race

package chunkstore

// raceEnabled: the race detector slows the chunker's byte loop about
// tenfold, so the tests of the real chunking use an eighth of the data.
const raceEnabled = true
