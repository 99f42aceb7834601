package sdk_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// A sandbox's whole life: create it, run a command streaming its output,
// delete it.
func Example() {
	ctx := context.Background()
	c, err := sdk.New("unix:///run/space.sock", os.Getenv("SPACE_API_KEY"))
	if err != nil {
		log.Fatal(err)
	}
	sb, err := c.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Limits: api.Limits{MemoryMiB: 512}})
	if err != nil {
		log.Fatal(err)
	}
	defer c.DeleteSandbox(ctx, sb.ID, true)

	st, err := c.Run(ctx, sb.ID, api.ExecRequest{Cmd: []string{"python3", "-c", "print(6*7)"}}, os.Stdout, os.Stderr)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("exit code", st.ExitCode)

	if _, err := c.Suspend(ctx, sb.ID); errors.Is(err, sdk.ErrNotSupported) {
		fmt.Println("this runtime cannot suspend:", err)
	}
}

// An interactive session: stdin, window size, and a re-attach-safe Wait.
func ExampleClient_Attach() {
	ctx := context.Background()
	c, _ := sdk.New(sdk.DefaultURL, os.Getenv("SPACE_API_KEY"))
	cmd, err := c.CreateCommand(ctx, "sb-123", api.CreateCommandRequest{
		ExecRequest: api.ExecRequest{Cmd: []string{"bash"}, TTY: true, Rows: 24, Cols: 80},
	})
	if err != nil {
		log.Fatal(err)
	}
	sess, err := c.Attach(ctx, cmd, sdk.AttachOptions{Stdout: os.Stdout, Stderr: os.Stderr})
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		fmt.Fprintln(sess.Stdin, "echo hello; exit 3")
		_ = sess.Resize(40, 120)
	}()
	st, err := sess.Wait()
	fmt.Println(st.ExitCode, err)
}
