package rules

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// R13: Retry-After is delay-seconds or an HTTP-date in three forms (RFC 9110).
func TestParseRetryAfter(t *testing.T) {
	now := time.Date(1994, 11, 6, 8, 49, 0, 0, time.UTC)
	ok := []struct {
		in   string
		want time.Duration
	}{
		{"0", 0},
		{"120", 120 * time.Second},
		{" 7 ", 7 * time.Second},
		{"\t30\t", 30 * time.Second},
		{"0000000042", 42 * time.Second},
		{"999999999", 999999999 * time.Second},               // largest accepted
		{"Sun, 06 Nov 1994 08:49:37 GMT", 37 * time.Second},  // IMF-fixdate
		{"Sunday, 06-Nov-94 08:49:37 GMT", 37 * time.Second}, // obsolete RFC 850
		{"Sun Nov  6 08:49:37 1994", 37 * time.Second},       // asctime
		{"Sun, 06 Nov 1994 10:49:00 GMT", 2 * time.Hour},
		{"Mon, 07 Nov 1994 08:49:00 GMT", 24 * time.Hour},
		{"Sun, 06 Nov 1994 08:49:00 GMT", 0},  // exactly now
		{"Sun, 06 Nov 1994 08:00:00 GMT", 0},  // past IMF-fixdate -> 0
		{"Sunday, 06-Nov-94 08:48:00 GMT", 0}, // past RFC 850 -> 0
		{"Sun Nov  6 07:00:00 1994", 0},       // past asctime -> 0
		{"Sun, 06 Nov 1994 08:49:00 GMT ", 0}, // trailing space trimmed
	}
	for _, tc := range ok {
		got, err := ParseRetryAfter(tc.in, now)
		if err != nil || got != tc.want {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "  ", "-1", "-0", "+5", "1.5", "1e3", "soon", "120s", "0x10", "12 34",
		"99999999999", "9227000000", "1000000001", "18446744073709551616", "Sun, 06 Nov 1994 08:49:37", "2026-01-02T10:20:00Z", "Sun, 32 Nov 1994 08:49:37 GMT", "NaN", "∞"} {
		if d, err := ParseRetryAfter(bad, now); err == nil {
			t.Errorf("ParseRetryAfter(%q) = %v, want an error", bad, d)
		}
	}
}

// R5: raw = min(max, base*2^attempt), overflow-safe.
func TestBackoffRaw(t *testing.T) {
	b := Backoff{Base: 5 * time.Second, Max: 120 * time.Second, JitterFloor: 1}
	tests := []struct {
		attempt int
		want    time.Duration
	}{
		{-3, 5 * time.Second}, {0, 5 * time.Second}, {1, 10 * time.Second}, {2, 20 * time.Second}, {3, 40 * time.Second},
		{4, 80 * time.Second}, {5, 120 * time.Second}, {6, 120 * time.Second}, {63, 120 * time.Second}, {64, 120 * time.Second},
		{1 << 30, 120 * time.Second}, {math.MaxInt, 120 * time.Second},
	}
	for _, tc := range tests {
		// floor 1 means no jitter: actual == raw whatever the random value.
		if got := BackoffDelay(b, tc.attempt, fixedRand(0.7)); got != tc.want {
			t.Errorf("attempt %d: %v, want %v", tc.attempt, got, tc.want)
		}
	}
	// A huge max never overflows.
	huge := Backoff{Base: time.Hour, Max: time.Duration(math.MaxInt64), JitterFloor: 0.5}
	for _, a := range []int{0, 10, 40, 62, 63, 100, math.MaxInt} {
		if d := BackoffDelay(huge, a, fixedRand(0.99)); d <= 0 {
			t.Errorf("attempt %d overflowed: %v", a, d)
		}
	}
	if d := BackoffDelay(Backoff{}, 3, fixedRand(0.5)); d != 0 {
		t.Errorf("zero backoff: %v", d)
	}
	if d := BackoffDelay(b, 2, nil); d != 20*time.Second {
		t.Errorf("nil rand gives raw: %v", d)
	}
}

// R5: the jitter stays within [floor*raw, raw] and actually varies.
func TestBackoffJitterStatistics(t *testing.T) {
	rnd := rand.New(rand.NewPCG(42, 1))
	for _, floor := range []float64{0.5, 0.1, 0.9, 1} {
		b := Backoff{Base: 2 * time.Second, Max: 60 * time.Second, JitterFloor: floor}
		for attempt := 0; attempt < 8; attempt++ {
			raw := rawBackoff(b, attempt)
			lo := time.Duration(math.Ceil(float64(raw) * floor))
			const n = 4000
			seen := map[time.Duration]bool{}
			var sum float64
			minD, maxD := time.Duration(math.MaxInt64), time.Duration(0)
			for i := 0; i < n; i++ {
				d := BackoffDelay(b, attempt, rnd)
				if d < lo || d > raw {
					t.Fatalf("floor %v attempt %d: %v outside [%v, %v]", floor, attempt, d, lo, raw)
				}
				seen[d] = true
				sum += float64(d)
				minD, maxD = min(minD, d), max(maxD, d)
			}
			if floor == 1 {
				if len(seen) != 1 {
					t.Fatalf("floor 1 must not jitter: %d values", len(seen))
				}
				continue
			}
			span := float64(raw) - float64(lo)
			// It varies: many distinct values, spread across most of the range.
			if len(seen) < n/2 || float64(maxD-minD) < 0.9*span {
				t.Fatalf("floor %v attempt %d: %d distinct values, spread %v of %v", floor, attempt, len(seen), maxD-minD, time.Duration(span))
			}
			// Uniform: the mean is near the middle (4000 samples: sd of mean ~ span/219).
			mid := float64(lo) + span/2
			if math.Abs(sum/n-mid) > span*0.03 {
				t.Fatalf("floor %v attempt %d: mean %v, want about %v", floor, attempt, time.Duration(sum/n), time.Duration(mid))
			}
		}
	}
}

func TestBackoffBadRandomValues(t *testing.T) {
	b := Backoff{Base: time.Second, Max: time.Minute, JitterFloor: 0.5}
	for _, f := range []float64{-1, 1, 2, math.NaN(), math.Inf(1)} {
		if d := BackoffDelay(b, 1, fixedRand(f)); d < time.Second || d > 2*time.Second {
			t.Errorf("rand %v: %v outside [1s, 2s]", f, d)
		}
	}
	// An invalid floor counts as the default 0.5.
	if d := BackoffDelay(Backoff{Base: 10 * time.Second, Max: time.Minute, JitterFloor: 7}, 0, fixedRand(0)); d != 5*time.Second {
		t.Errorf("invalid floor: %v", d)
	}
}

func TestShortDuration(t *testing.T) {
	for in, want := range map[time.Duration]string{15 * time.Minute: "15m", time.Hour: "1h", 90 * time.Second: "1m30s", 2*time.Hour + 5*time.Minute: "2h5m", 500 * time.Millisecond: "500ms"} {
		if got := ShortDuration(in); got != want {
			t.Errorf("ShortDuration(%v) = %q, want %q", in, got, want)
		}
	}
}

func TestClipKeepsRunes(t *testing.T) {
	s := strings.Repeat("ä", 10) // 20 bytes
	for n := 0; n < 22; n++ {
		if got := clip(s, n); !utf8.ValidString(got) || len(got) > n+3 {
			t.Fatalf("clip(%d) = %q", n, got)
		}
	}
}
