package server

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
)

// failingWriter fails every write after the first n.
type failingWriter struct {
	*httptest.ResponseRecorder
	n      int
	writes int
}

func (f *failingWriter) Write(b []byte) (int, error) {
	f.writes++
	if f.writes > f.n {
		return 0, errors.New("client gone")
	}
	return f.ResponseRecorder.Write(b)
}

func TestNDJSONWriter(t *testing.T) {
	rec := httptest.NewRecorder()
	nd := newNDJSON(rec, 0)
	if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/x-ndjson" || !rec.Flushed {
		t.Fatalf("head: %d %v flushed=%v", rec.Code, rec.Header(), rec.Flushed)
	}
	rec.Flushed = false
	if err := nd.Send(map[string]int{"a": 1}); err != nil || rec.Body.String() != "{\"a\":1}\n" || !rec.Flushed {
		t.Fatalf("send: %v %q flushed=%v", err, rec.Body, rec.Flushed)
	}
	nd.Close()

	fw := &failingWriter{ResponseRecorder: httptest.NewRecorder(), n: 1}
	nd = newNDJSON(fw, 0)
	if err := nd.Send(1); err != nil {
		t.Fatal(err)
	}
	if err := nd.Send(2); err == nil {
		t.Fatal("a failed write was not reported")
	}
	if err := nd.Send(3); err == nil || fw.writes != 2 {
		t.Fatalf("after a failure: err %v, %d writes (want the failure to stick, no more writes)", err, fw.writes)
	}
	if err := nd.Send(func() {}); err == nil {
		t.Fatal("unencodable value accepted")
	}
	if fw.Body.String() != "1\n" {
		t.Fatalf("body %q", fw.Body)
	}
}
