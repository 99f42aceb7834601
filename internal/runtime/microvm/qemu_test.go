package microvm

import (
	"strings"
	"testing"
)

func TestParseTSCKHz(t *testing.T) {
	block := func(mhz, flags string) string {
		return "processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: " + mhz + "\nflags\t\t: " + flags + "\n\nprocessor\t: 1\ncpu MHz\t\t: 999.000\n"
	}
	for _, tc := range []struct {
		name, info string
		want       uint64
	}{
		{"constant", block("2096.010", "fpu tsc constant_tsc nonstop_tsc tsc_known_freq"), 2096010},
		{"no constant_tsc", block("2096.010", "fpu tsc nonstop_tsc"), 0},
		{"aperfmperf shows the core clock", block("3400.000", "constant_tsc nonstop_tsc aperfmperf"), 0},
		{"garbage", block("fast", "constant_tsc nonstop_tsc"), 0},
		{"empty", "", 0},
	} {
		if got := parseTSCKHz(tc.info); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestArgsRefuseUnsafePaths(t *testing.T) {
	ok := VM{Kernel: "/k", Initrd: "/i", Accel: AccelTCG, AgentSocket: "/s", ConsoleLog: "/c"}
	args, err := ok.Args()
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(args, " ")
	for _, want := range []string{"-M microvm", "-accel tcg", "-no-reboot", "path=/s,server=on,wait=off", "name=agent", "-- init-microvm", "panic=-1"} {
		if !strings.Contains(joined, want) {
			t.Errorf("args lack %q: %s", want, joined)
		}
	}
	for name, vm := range map[string]VM{
		"comma":       {Kernel: "/k,evil=1", Initrd: "/i", Accel: AccelTCG, AgentSocket: "/s", ConsoleLog: "/c"},
		"long socket": {Kernel: "/k", Initrd: "/i", Accel: AccelTCG, AgentSocket: "/" + strings.Repeat("s", 120), ConsoleLog: "/c"},
		"accel":       {Kernel: "/k", Initrd: "/i", Accel: "hvf", AgentSocket: "/s", ConsoleLog: "/c"},
		"empty":       {Initrd: "/i", Accel: AccelTCG, AgentSocket: "/s", ConsoleLog: "/c"},
	} {
		if _, err := vm.Args(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
