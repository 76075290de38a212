package metrics

import (
	"testing"
	"time"
)

func TestKVTransferLogLine(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	const mib = 1 << 20
	tests := []struct {
		name string
		iv   TransferInterval
		want string
	}{
		{
			// Hand-computed: xfer {1,2,3,10} ms → mean 4.0, P90 at virtual index 2.7 → 3+0.7·7 = 7.9;
			// post {0.1..0.4} ms → mean 0.25, P90 0.37; 10 MiB over 4 → 2.5 MB; 10 MB / 0.016 s = 625;
			// descriptors 101/4 = 25.25 → 25.2 (round half to even, like Python); failed 1+2.
			name: "four transfers",
			iv: TransferInterval{
				Transfers: []TransferSample{
					{Duration: ms(3), PostDuration: ms(0.3), Bytes: 3 * mib, Descriptors: 30},
					{Duration: ms(1), PostDuration: ms(0.1), Bytes: 1 * mib, Descriptors: 10},
					{Duration: ms(10), PostDuration: ms(0.4), Bytes: 4 * mib, Descriptors: 41},
					{Duration: ms(2), PostDuration: ms(0.2), Bytes: 2 * mib, Descriptors: 20},
				},
				FailedTransfers:     1,
				FailedNotifications: 2,
				ExpiredRequests:     1,
			},
			want: "KV Transfer metrics: Num successful transfers=4, Avg xfer time (ms)=4.0, " +
				"P90 xfer time (ms)=7.9, Avg post time (ms)=0.25, P90 post time (ms)=0.37, " +
				"Avg MB per transfer=2.5, Throughput (MB/s)=625.0, Avg number of descriptors=25.2, " +
				"Num failed transfers=3, Num KV expired reqs=1",
		},
		{
			// One sample: 1.234567 ms → 1.235; 1.5 MiB / 0.001234567 s = 1215.0008… → 1215.001;
			// the P90 of one value is the value.
			name: "one transfer",
			iv: TransferInterval{Transfers: []TransferSample{
				{Duration: 1234567 * time.Nanosecond, PostDuration: 250 * time.Microsecond, Bytes: 1536 * 1024, Descriptors: 7},
			}},
			want: "KV Transfer metrics: Num successful transfers=1, Avg xfer time (ms)=1.235, " +
				"P90 xfer time (ms)=1.235, Avg post time (ms)=0.25, P90 post time (ms)=0.25, " +
				"Avg MB per transfer=1.5, Throughput (MB/s)=1215.001, Avg number of descriptors=7.0, " +
				"Num failed transfers=0, Num KV expired reqs=0",
		},
		{
			name: "only failures",
			iv:   TransferInterval{FailedTransfers: 2, ExpiredRequests: 5},
			want: "KV Transfer metrics: Num successful transfers=0, Avg xfer time (ms)=0, " +
				"P90 xfer time (ms)=0, Avg post time (ms)=0, P90 post time (ms)=0, " +
				"Avg MB per transfer=0, Throughput (MB/s)=0, Avg number of descriptors=0, " +
				"Num failed transfers=2, Num KV expired reqs=5",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := KVTransferLogLine(tt.iv); got != tt.want {
				t.Errorf("got\n%s\nwant\n%s", got, tt.want)
			}
		})
	}
}

func TestTransferIntervalEmpty(t *testing.T) {
	if !(TransferInterval{}).Empty() {
		t.Error("zero interval not empty")
	}
	if (TransferInterval{FailedNotifications: 1}).Empty() {
		t.Error("interval with a failed notification reported empty")
	}
}

func TestPyRound(t *testing.T) {
	tests := []struct {
		x    float64
		d    int
		want string
	}{
		{2, 3, "2.0"}, {2.5, 3, "2.5"}, {0.0004, 3, "0.0"}, {1.0006, 3, "1.001"},
		{25.25, 1, "25.2"}, {25.35, 1, "25.4"}, {1e6, 3, "1000000.0"},
	}
	for _, tt := range tests {
		if got := pyRound(tt.x, tt.d); got != tt.want {
			t.Errorf("pyRound(%v, %d) = %q, want %q", tt.x, tt.d, got, tt.want)
		}
	}
}

func TestPairwiseSumMatchesPlainSumOnExactValues(t *testing.T) {
	a := make([]float64, 300)
	for i := range a {
		a[i] = float64(i)
	}
	for _, n := range []int{0, 1, 7, 8, 9, 128, 129, 300} {
		var w float64
		for _, v := range a[:n] {
			w += v
		}
		if got := pairwiseSum(a[:n]); got != w {
			t.Errorf("pairwiseSum(n=%d) = %v, want %v", n, got, w)
		}
	}
}
