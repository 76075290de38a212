package reliability

import (
	"testing"

	"github.com/kvbridge/kvbridge/connector"
)

// Faults with tensor parallelism: P and D each run 2 ranks, so that D's load is one READ per
// rank pair and P's lease holds every rank's KV.

// TestTPProducerKilledDuringRead is TestProducerKilledDuringRead at TP 2 on both sides: P dies
// while D's per-rank READs wait; D fails the load at once (500 under fail), counts it, and its
// pool — every rank's blocks — is full.
func TestTPProducerKilledDuringRead(t *testing.T) {
	t.Parallel()
	producerKilledDuringRead(t, connector.PolicyFail, 2)
}

// TestTPDecoderKilledDuringRead is TestDecoderKilledDuringRead at TP 2 on both sides: D dies
// while P's READ data is held; P's lease expires and frees the blocks of both its ranks.
func TestTPDecoderKilledDuringRead(t *testing.T) {
	t.Parallel()
	decoderKilledDuringRead(t, 2)
}
