package microvm

import (
	"context"
	"errors"
)

// Warm templates (engineer S replaces these stubs): Start first asks
// startWarm for a restore from a warm snapshot of the sandbox's kind and
// boots cold on errNoWarm; after a cold boot whose agent answered, it
// calls afterColdBoot, which may take such a snapshot.

var errNoWarm = errors.New("no warm snapshot")

func (i *instance) startWarm(ctx context.Context) error { return errNoWarm }

func (i *instance) afterColdBoot(ctx context.Context) {}
