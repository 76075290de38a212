package model

// stepPart names a part of a forward step, for measurements of where a step's wall time goes
// (Model.mark): a part runs from its mark to the next one, on the goroutine that called Forward.
type stepPart uint8

const (
	partEmbed     stepPart = iota // embeddings, RoPE's angles, planning the step
	partViews                     // a layer's KV views
	partNorm                      // an RMSNorm before attention or the MLP
	partQKV                       // the q, k, v product
	partPrepare                   // biases, q/k norms, RoPE, writing the KV (prepareToken)
	partAttention                 // attention's work items (scores of split sequences)
	partSoftmax                   // a split sequence's probabilities (finishSplits)
	partValues                    // a split sequence's value sums per chunk
	partChunkSums                 // a split sequence's chunk sums into the attention rows
	partO                         // the output projection
	partResidual                  // adding a block's output to the residual stream
	partGateUp                    // the gate and up products
	partSiLU                      // SiLU(gate)·up
	partDown                      // the down product
	partLMHead                    // the final norm and lm_head
	partLogitsOut                 // handing the logits to the sequences
	partEnd                       // Forward returns
	numParts
)

var partNames = [numParts]string{"embed", "views", "norm", "qkv", "prepare", "attention", "softmax", "values", "chunk sums",
	"o", "residual", "gate/up", "silu", "down", "lm_head", "logits out", "end"}

func (p stepPart) String() string { return partNames[p] }

// at marks the start of part p of a step when a measurement observes the step (Model.mark).
func (m *Model) at(p stepPart) {
	if m.mark != nil {
		m.mark(p)
	}
}
