package confine

import (
	"slices"
	"testing"
)

func TestChannelFDs(t *testing.T) {
	got := channelFDs([]string{"--socket", "/proc/self/fd/7/agent.sock", "--serial=/proc/self/fd/12", "-v", "/proc/self/fd/x"})
	if !slices.Equal(got, []int{7, 12}) {
		t.Fatalf("channelFDs = %v", got)
	}
}

// HideChannel with neither flag changes nothing (and needs no privilege).
func TestHideChannelOther(t *testing.T) {
	in := []string{"--fd", "3", "-v"}
	out, err := HideChannel(in)
	if err != nil || !slices.Equal(out, in) {
		t.Fatalf("HideChannel(%q) = %q, %v", in, out, err)
	}
	if _, err := HideChannel([]string{"--socket"}); err == nil {
		t.Fatal("--socket without a value accepted")
	}
}
