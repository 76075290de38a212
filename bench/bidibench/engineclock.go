package bidibench

import (
	"fmt"
	"time"

	"github.com/kvbridge/kvbridge/metrics"
)

// ttftSeries is the histogram an engine's OpenAI server records each request's time to first
// token in, from the engine accepting the request to its first output.
const ttftSeries = "vllm:time_to_first_token_seconds"

// engineTTFT reads the running total of an engine's server-side TTFT histogram. Requests are
// sent one at a time, so the difference of two readings around a request is that request's
// engine-side TTFT.
func engineTTFT(reg *metrics.Registry) (time.Duration, error) {
	mfs, err := reg.Prometheus().Gather()
	if err != nil {
		return 0, fmt.Errorf("bidibench: gather metrics: %w", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != ttftSeries {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			sum += m.GetHistogram().GetSampleSum()
		}
		return time.Duration(sum * float64(time.Second)), nil
	}
	return 0, nil // no request has produced a token yet
}
