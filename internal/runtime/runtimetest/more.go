package runtimetest

import "testing"

func testPTY(t *testing.T, h Harness)       { t.Skip("todo") }
func testFiles(t *testing.T, h Harness)     { t.Skip("todo") }
func testLimits(t *testing.T, h Harness)    { t.Skip("todo") }
func testIsolation(t *testing.T, h Harness) { t.Skip("todo") }
func testPause(t *testing.T, h Harness)     { t.Skip("todo") }
