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
	producerKilledDuringRead(t, connector.PolicyFail, 2, 2)
}

// TestTPDecoderKilledDuringRead is TestDecoderKilledDuringRead at TP 2 on both sides: D dies
// while P's READ data is held; P's lease expires and frees the blocks of both its ranks.
func TestTPDecoderKilledDuringRead(t *testing.T) {
	t.Parallel()
	decoderKilledDuringRead(t, 2, 2)
}

// TestTPAcrossSizesProducerKilledDuringRead: P at TP 2 dies while D (TP 1) waits for the READs
// that assemble its heads from both P ranks: D fails the load at once, counts it, and its pool
// is full.
func TestTPAcrossSizesProducerKilledDuringRead(t *testing.T) {
	t.Parallel()
	producerKilledDuringRead(t, connector.PolicyFail, 2, 1)
}

// TestTPAcrossSizesDecoderKilledDuringRead: D at TP 2 dies while its ranks read their head
// slices of P's one rank (P's data held): P's lease expires and frees the blocks.
func TestTPAcrossSizesDecoderKilledDuringRead(t *testing.T) {
	t.Parallel()
	decoderKilledDuringRead(t, 1, 2)
}
